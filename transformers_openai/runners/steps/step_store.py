"""Compiled steps kept on disk between starts: `torch.compile`'s ahead-of-time compile (`aot_compile`), saved once
and loaded by later starts in a second or two where compiling takes minutes.

A stored step is found by a key over everything its compiled code depends on that its guards do not check: the
versions of torch and transformers, the source of the modules a decode step's trace goes through (`TRACED_MODULES`,
not the whole package: an unrelated change does not recompile), the CPU's instruction set and what the caller names
(the model's configuration, its weights' layout, the step's sizes). Its guards then check the rest on load (the
shapes, strides and dtypes of the weights, the K/V pool and the step's buffers), once: a step whose guards fail is
compiled anew and stored over the old one. Calls skip the guards: the caller only ever passes inputs of the compiled
layout. Torch's thread count is not among them: a step stored under one count serves any other (`GLOBAL_STATE`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.guards import CheckFunctionManager
from torch._inductor import config as inductor_config
from torch._inductor.cpu_vec_isa import valid_vec_isa_list

logger = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parents[2]  # transformers_openai
# The only guards a stored step keeps on what it reaches through a model's submodules (_storable_guards): those on
# tensors (the weights' shapes, strides and dtypes). MODULE_SOURCE is in the name of every such value.
KEPT_MODULE_GUARDS = frozenset({"TENSOR_MATCH"})
MODULE_SOURCE = "._modules["
VEC_ISA_RECORD = "vec-isa"  # in a store: the instruction sets inductor's probe accepted (trust_recorded_vec_isas)
COMPILE_SECONDS_RECORD = "compile-seconds"  # in a store: how long the last compile of a decode step took
# The modules whose code a decode step's trace runs (or whose constants and compile options it bakes in): the store
# key hashes their source. tests/unit/test_fixed_steps.py fails when the step calls into a module of this package
# missing here.
TRACED_MODULES = (
    "transformers_openai.runners.packed_linear",
    "transformers_openai.runners.kernels.gemv_kernel",
    "transformers_openai.runners.kernels.paged_attention",
    "transformers_openai.runners.kernels.paged_decode_kernel",
    "transformers_openai.runners.kv.block_table",
    "transformers_openai.runners.kv.paged_cache",
    "transformers_openai.runners.steps.fixed_steps",
    "transformers_openai.runners.steps.paged_step",
    "transformers_openai.runners.steps.step_store",
)
# The global state a stored step was compiled under is checked on load without this entry (`_global_state`).
THREAD_COUNT_STATE = "num_threads"


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU kernels (and ours) are built with here: $CXX, else g++, c++ or clang++."""
    named = os.environ.get("CXX")
    return next(
        filter(None, (shutil.which(name) for name in ([named] if named else []) + ["g++", "c++", "clang++"])), None
    )


def has_cxx_compiler() -> bool:
    """Whether inductor's CPU kernels can be built here."""
    return cxx_compiler() is not None


def store_key(parts: Iterable[str], modules: Iterable[str] = TRACED_MODULES) -> str:
    """The key of a stored step: the caller's `parts` with the versions, the source of the traced `modules` and the
    CPU's instruction set."""
    digest = hashlib.sha256()
    for part in (torch.__version__, metadata.version("transformers"), platform.machine(), cpu_flags(), *parts):
        digest.update(part.encode())
        digest.update(b"\0")
    for source in traced_sources(modules):
        digest.update(source.relative_to(PACKAGE).as_posix().encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:32]


def traced_sources(modules: Iterable[str] = TRACED_MODULES) -> list[Path]:
    """The source files of `modules` (found without importing them)."""
    found = []
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise ModuleNotFoundError(f"no source for the traced module {name}")
        found.append(Path(spec.origin).resolve())
    return found


def record_compile_seconds(store: Path, seconds: float) -> None:
    """Keeps in `store` how long a compile of the decode step took, for the next start's log."""
    try:
        (store / COMPILE_SECONDS_RECORD).write_text(f"{seconds:.0f}\n")
    except OSError:
        logger.debug("could not record the compile's duration in %s", store, exc_info=True)


def last_compile_seconds(store: Path) -> float | None:
    """How long the last compile of a decode step in `store` took (None: none recorded)."""
    try:
        return float((store / COMPILE_SECONDS_RECORD).read_text())
    except (OSError, ValueError):
        return None


def cpu_flags() -> str:
    """The instruction-set flags of this CPU (Linux; elsewhere torch's own summary of them)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def compiled_step(
    fn: Callable[..., torch.Tensor],
    example: Sequence[Any],
    dynamic: Sequence[tuple[int, int]],
    path: Path | None,
) -> tuple[Callable[..., torch.Tensor], bool]:
    """`fn` compiled for calls like `example` (dims `(argument, dim)` of `dynamic` symbolic): loaded from `path`
    when a step stored there passes its guards on `example`, else compiled here (minutes) and stored there. True
    when loaded."""
    if path is not None:
        loaded = stored_step(fn, example, path)
        if loaded is not None:
            return loaded, True
    # Marked on aliases of their own (same strides and offsets): the caller's tensors stay unmarked (a loaded step's
    # guards reject marked ones).
    inputs = [value[...] if isinstance(value, torch.Tensor) else value for value in example]
    for argument, dim in dynamic:
        torch._dynamo.maybe_mark_dynamic(inputs[argument], dim)  # sizes of 1 stay specialised
    # The wrapper that calls the step's kernels in C++ too: Python's (views, size checks, one binding call per
    # kernel) took a quarter of a 16-row step of a narrow model (`loadtest host-cost`). Its kernels take as many
    # threads as the calling thread has at run time, not the count of the compiling process baked in: one stored
    # step serves any thread count, and the engine may run it on fewer threads while another process holds a core.
    options: dict[str, Any] = {"guard_filter_fn": _storable_guards, "cpp_wrapper": True, "cpp.dynamic_threads": True}
    compiler: Any = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
    compiled = compiler.aot_compile((tuple(inputs), {}))
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            compiled.save_compiled_function(str(path))
            (path.parent / VEC_ISA_RECORD).write_text(usable_vec_isas())
            _state_record(path).write_text(_global_state())
        except (OSError, RuntimeError):
            logger.warning("could not store the compiled step in %s: the next start compiles it again", path)
    compiled.disable_guard_check()
    return compiled, False


def stored_step(fn: Callable[..., torch.Tensor], example: Sequence[Any], path: Path) -> Any:
    """The step stored at `path` for calls like `example`, guards checked once (then off); None when there is none,
    it cannot be read, or it was compiled for other inputs or another global state (said in the log). Loads only:
    a caller off the thread that runs the step may call it (nothing is run)."""
    keep_compiler_cache(path.parent)
    if not path.exists():
        return None
    trust_recorded_vec_isas(path.parent)
    try:
        recorded = _state_record(path).read_text()
    except OSError:
        recorded = None
    if recorded != _global_state():
        logger.info("the step in %s was compiled under another global state (%s): not used", path, recorded)
        return None
    try:
        with path.open("rb") as stored:
            loaded: Any = torch.compiler.load_compiled_function(stored, f_globals=fn.__globals__)
        if loaded.guard_check(*example):
            loaded.disable_guard_check()
            return loaded
        failed = loaded._artifacts.guard_manager.check_verbose(loaded.prepare_f_locals(*example))
        logger.info("the step in %s was compiled for other inputs (%s): not used", path, failed.verbose_code_parts)
    except Exception:  # a file cut short, or written by an incompatible build
        logger.warning("could not load the compiled step in %s", path, exc_info=True)
    return None


def _global_state() -> str:
    """Torch's global state a compiled step depends on (grad mode, default dtype, autocast, deterministic algorithms,
    torch function modes...), as dynamo's GLOBAL_STATE guard reads it, less the thread count: inductor's kernels
    take the calling thread's count at run time (`cpp.dynamic_threads`)."""
    state = json.loads(str(torch._C._dynamo.guards.GlobalStateGuard().__getstate__()))
    state.pop(THREAD_COUNT_STATE, None)
    return json.dumps(state, sort_keys=True)


def _state_record(path: Path) -> Path:
    """Where the global state the step at `path` was compiled under is kept."""
    return path.with_suffix(".state")


def private_store(path: Path) -> Path:
    """`path` made (mode 0700) and checked as a place to keep compiled steps, whose pickles and shared libraries a
    start loads and runs; a temporary private directory instead, with a warning, when another user could have put
    files there (`store_problem`): those would run as this server's user."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = store_problem(path)
    except OSError as exc:
        problem = f"it cannot be made ({exc})"
    if problem is None:
        return path
    fallback = Path(tempfile.mkdtemp(prefix="transformers-openai-steps-"))
    logger.warning(
        "not using %s for compiled steps: %s; this start compiles into %s, which no later start reuses",
        path,
        problem,
        fallback,
    )
    return fallback


def store_problem(path: Path) -> str | None:
    """Why another user could write into `path` (None when none can): it is not this user's, or its group or others
    may write it, or a folder above it is writable by others without the sticky bit (they could move it aside) or
    belongs to a user other than this one and root."""
    uid = os.getuid()
    info = path.stat()
    if info.st_uid != uid:
        return f"it belongs to user {info.st_uid}"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"its group or other users may write it (mode {stat.filemode(info.st_mode)})"
    for parent in path.resolve().parents:
        above = parent.stat()
        if above.st_uid not in (uid, 0):
            return f"{parent} belongs to user {above.st_uid}"
        if above.st_mode & stat.S_IWOTH and not above.st_mode & stat.S_ISVTX:
            return f"any user may write {parent} (mode {stat.filemode(above.st_mode)})"
    return None


def keep_compiler_cache(store: Path) -> None:
    """Inductor's own cache (the C++ it builds for a step: kernels and wrapper) kept in `store` beside the stored
    steps: a stored step's code is built again when that cache is gone (minutes a graph, where a load takes
    seconds), and inductor's default place, under /tmp, may not outlive the machine's next start.
    Inductor reads TORCHINDUCTOR_CACHE_DIR whenever it needs its cache (torch's own imports set it to the default,
    so a value found there is not the user's choice: `store` replaces it). Its precompiled C++ headers, which it
    otherwise keeps at a fixed path in the system's temporary folder (any user can make that path first), go there
    too."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(store / "inductor")
    from torch._inductor import codecache

    if hasattr(codecache, "_HEADER_DIR"):  # read when a header is precompiled
        codecache._HEADER_DIR = str(store / "inductor" / "precompiled_headers")
        codecache._HEADER_LOCK_DIR = str(store / "inductor" / "precompiled_headers" / "locks")


def usable_vec_isas() -> str:
    """The SIMD instruction sets inductor may build kernels for here, best first: those this CPU reports that a
    probe found the compiler and loader accept (or, while inductor trusts the CPU, all it reports)."""
    return "".join(f"{isa}\n" for isa in valid_vec_isa_list())  # one a line (a set's name may hold spaces)


def trust_recorded_vec_isas(store: Path) -> None:
    """Spares a start inductor's probe of the CPU's instruction sets where a compile in `store` recorded its outcome.

    Before it loads a stored step's C++, inductor decides once per process which instruction sets it may use: for
    each one the CPU reports, it builds a small library and loads it in a new Python process (seconds of every
    start; the choice is part of the key under which it finds the step's built code). A compile
    records what that probe accepted (`VEC_ISA_RECORD`); where this CPU reports exactly those sets, inductor takes
    them without probing, else (another CPU, or nothing recorded) it probes as usual."""
    if valid_vec_isa_list.cache_info().currsize:  # decided already in this process
        return
    try:
        recorded = (store / VEC_ISA_RECORD).read_text()
    except OSError:
        return
    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        reported = usable_vec_isas()  # from /proc/cpuinfo alone; inductor keeps this list for the process
    if reported != recorded:
        valid_vec_isa_list.cache_clear()  # probed when next needed


def _storable_guards(entries: Sequence[Any]) -> list[bool]:
    """The guards a stored step keeps: not those on globals (functions and classes, as the key's versions pin
    them), not the kinds torch cannot store (object identities), not those on oneDNN-packed weights (their layout
    has no storable description; the key names it), and, of those on what the step reaches through a model's
    submodules, only those on tensors. The others read what the code and the model's configuration decide, which
    the key pins (the versions, this package's source, the configuration, each module's name and type): a module's
    type, its hook dicts being empty, its integer and flag attributes. They were nine in ten of a decode step's
    guards, and a start builds each kept guard again (most of the time a load took). Not the guard on torch's global
    state either: it refuses a step under another thread count, and the rest of what it reads is recorded beside the
    step and compared on load (`_global_state`)."""
    unstorable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    return [
        not (
            entry.is_global
            or entry.guard_type in unstorable
            or any(kind in unstorable for kind in entry.derived_guard_types)
            or (entry.has_value and isinstance(entry.value, torch.Tensor) and entry.value.layout != torch.strided)
            or entry.guard_type in ("EMPTY_NN_MODULE_HOOKS_DICT", "GLOBAL_STATE")
            or (MODULE_SOURCE in entry.name and entry.guard_type not in KEPT_MODULE_GUARDS)
        )
        for entry in entries
    ]
