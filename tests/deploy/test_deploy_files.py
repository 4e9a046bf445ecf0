"""The deployment files agree with the code: docker-compose.yaml passes every Settings field through under each of
its names with defaults that validate, its defaults serve the README's examples (their model name, the tools
template), the Dockerfile starts the server through deploy/entrypoint.py as a non-root user with a /health probe and
the torch the scripts install, deploy/nginx.conf streams, and the compose CLI (when installed) accepts the file."""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import AliasChoices

from transformers_openai.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
NGINX_CONF = ROOT / "deploy" / "nginx.conf"
HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"
HEALTHCHECK_SCRIPT = ROOT / "deploy" / "healthcheck.py"
ENTRYPOINT_SCRIPT = ROOT / "deploy" / "entrypoint.py"
ENV_SCRIPT = ROOT / "scripts" / "env.sh"
README = ROOT / "README.md"
DOCS = ROOT / "docs"  # the README's details: usage.md states the torch version

SERVER_MODULE = ["-m", "transformers_openai.main"]
SERVER_SERVICES = ("server", "cpu", "replica", "gpu0", "gpu1", "cpu1", "cpu2")
ALL_PROFILES = ("cpu", "replicas", "haproxy", "haproxy-cpu")
# Settings fields the compose file deliberately leaves out, with the reason. None today.
NOT_PASSED_THROUGH: dict[str, str] = {}
# Environment variables of the server services that are not Settings: libraries in the process read them.
NON_SETTINGS_ENV = {
    "HF_TOKEN": "huggingface_hub: token for gated or private models",
    "HF_HUB_OFFLINE": "huggingface_hub: no hub calls once the model is cached",
    "CUDA_VISIBLE_DEVICES": "CUDA: the one GPU a replica of the haproxy profile sees",
}
# Environment variables deploy/entrypoint.py reads before it starts the server.
ENTRYPOINT_ENV = {"GPU_REPLICAS": "replicas sharing one GPU: each K/V cache takes 0.85 / N of its free memory"}
# What the compose file pins on purpose, whatever the host says (so the Settings default does not apply).
PINNED = {
    "server": {"host": "0.0.0.0"},
    "cpu": {"host": "0.0.0.0", "device": "cpu"},
    "replica": {"host": "0.0.0.0"},
    **{name: {"host": "0.0.0.0", "replica_id": name} for name in ("gpu0", "gpu1")},
    **{name: {"host": "0.0.0.0", "device": "cpu", "replica_id": name} for name in ("cpu1", "cpu2")},
}


# ---------------------------------------------------------------------------------------------------- helpers


def env_names_by_field() -> dict[str, list[str]]:
    """Field name -> the environment variable names (upper case) Settings reads it from, in priority order."""
    names: dict[str, list[str]] = {}
    for field_name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            choices = [choice for choice in alias.choices if isinstance(choice, str)]
        elif isinstance(alias, str):
            choices = [alias]
        else:
            choices = [field_name]
        names[field_name] = [choice.upper() for choice in choices]
    return names


def field_of_env_name() -> dict[str, str]:
    return {env: field for field, envs in env_names_by_field().items() for env in envs}


def load_compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE_FILE.read_text())  # resolves the `<<` merge keys as compose does
    assert isinstance(loaded, dict)
    return loaded


def service(name: str) -> dict[str, Any]:
    services = load_compose()["services"]
    assert name in services, f"docker-compose.yaml has no service {name!r}"
    found: dict[str, Any] = services[name]
    return found


def raw_environment(svc: Mapping[str, Any]) -> dict[str, Any]:
    env = svc.get("environment") or {}
    if isinstance(env, list):  # list form: KEY=VALUE or a bare KEY
        return {item.split("=", 1)[0]: (item.split("=", 1)[1] if "=" in item else None) for item in env}
    return dict(env)


_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value: str, host: Mapping[str, str]) -> str:
    """Compose's variable substitution: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}."""

    def replace(match: re.Match[str]) -> str:
        if match.group(1):
            return "$"
        name = match.group(2) or match.group(5)
        operator, argument = match.group(3), match.group(4) or ""
        current = host.get(name)
        if operator == ":-":
            return current if current else argument
        if operator == "-":
            return argument if current is None else current
        if operator in (":?", "?") and (current is None or (operator == ":?" and not current)):
            raise KeyError(f"{name} is required: {argument}")
        return current or ""

    return _VARIABLE.sub(replace, value)


def resolved_environment(svc: Mapping[str, Any], host: Mapping[str, str]) -> dict[str, str]:
    """The variables the container gets; a key without a value is taken from the host, and left out if unset."""
    resolved: dict[str, str] = {}
    for key, raw in raw_environment(svc).items():
        if raw is None:
            if key in host:
                resolved[key] = host[key]
        else:
            text = str(raw).lower() if isinstance(raw, bool) else str(raw)
            resolved[key] = interpolate(text, host)
    return resolved


def settings_under(monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str]) -> Settings:
    known = set(field_of_env_name())
    for name in list(os.environ):
        if name.upper() in known:
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return Settings()  # every field comes from the environment or its default


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with continuation lines joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, arguments = full.partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def instruction_args(keyword: str) -> list[str]:
    return [arguments for name, arguments in dockerfile_instructions() if name == keyword]


def exec_form(arguments: str) -> list[str]:
    parsed = json.loads(arguments)
    assert isinstance(parsed, list) and all(isinstance(part, str) for part in parsed), arguments
    return parsed


def key_values(arguments: str) -> dict[str, str]:
    """ENV/ARG arguments (KEY=VALUE pairs, or the legacy `KEY VALUE`)."""
    parts = shlex.split(arguments)
    if len(parts) >= 2 and "=" not in parts[0]:
        return {parts[0]: " ".join(parts[1:])}
    pairs = [part.partition("=") for part in parts]
    return {key: value for key, _, value in pairs}


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for arguments in instruction_args("ENV"):
        env.update(key_values(arguments))
    return env


def path_in_image(source: str) -> str:
    """Where the Dockerfile COPYs `source` (a file, or a folder copied whole)."""
    for arguments in instruction_args("COPY"):
        parts = [part for part in shlex.split(arguments) if not part.startswith("--")]
        if source in parts[:-1]:
            dest = parts[-1]
            return dest + Path(source).name if dest.endswith("/") else dest
    raise AssertionError(f"the Dockerfile does not COPY {source}")


def healthcheck_path_in_image() -> str:
    return path_in_image("deploy/healthcheck.py")


def entrypoint_module() -> Any:
    spec = importlib.util.spec_from_file_location("entrypoint", ENTRYPOINT_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def container_environment(svc: Mapping[str, Any], host: Mapping[str, str]) -> dict[str, str]:
    """What the server process sees: the service's resolved environment after deploy/entrypoint.py's defaults."""
    return entrypoint_module().server_environment(resolved_environment(svc, host), [])


def in_repository(template: Path) -> Path:
    """The repository file behind a chat template path the entry point gives: run from deploy/ here, it points into
    deploy/chat-templates; in the image, into the folder the Dockerfile copies that to."""
    if template.is_relative_to(ENTRYPOINT_SCRIPT.parent):
        return template
    relative = template.relative_to(path_in_image("deploy/chat-templates"))
    return ROOT / "deploy" / "chat-templates" / relative


def readme_model_names() -> set[str]:
    """The `model=` of the README's Python examples for text models (Whisper's and the embedding model's are served
    by their own scripts)."""
    names = set(re.findall(r'model="([^"]+)"', README.read_text()))
    return {name for name in names if "whisper" not in name and name != "all-MiniLM-L6-v2"}


def torch_spec_of_env_script() -> str:
    found = re.search(r'TORCH_SPEC="\$\{TORCH_SPEC:-([^}]+)\}"', ENV_SCRIPT.read_text())
    assert found, "scripts/env.sh does not default TORCH_SPEC"
    return found.group(1)


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


def host_environment_without_settings() -> dict[str, str]:
    known = (
        set(field_of_env_name()) | set(NON_SETTINGS_ENV) | set(ENTRYPOINT_ENV) | {"REPLICAS", "LB_PORT", "LB_BALANCE"}
    )
    return {name: value for name, value in os.environ.items() if name.upper() not in known}


# ------------------------------------------------------------------------------------ (a) compose <-> Settings


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_every_compose_variable_is_a_setting(name: str) -> None:
    known = field_of_env_name()
    allowed = set(known) | set(NON_SETTINGS_ENV) | set(ENTRYPOINT_ENV)
    unknown = [key for key in raw_environment(service(name)) if key not in allowed]
    assert not unknown, f"{name}: no Settings field or alias reads {unknown}"


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_every_setting_is_passed_through(name: str) -> None:
    keys = set(raw_environment(service(name)))
    missing = [
        field
        for field, envs in env_names_by_field().items()
        if field not in NOT_PASSED_THROUGH and not keys.intersection(envs)
    ]
    assert not missing, f"{name}: settings not passed through: {missing} (or list them in NOT_PASSED_THROUGH)"
    stale = [field for field in NOT_PASSED_THROUGH if field not in Settings.model_fields]
    assert not stale, f"NOT_PASSED_THROUGH names fields Settings no longer has: {stale}"


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_every_name_of_a_setting_is_passed_through(name: str) -> None:
    # docs/options.md documents MODEL and HF_MODEL, DTYPE and TORCH_DTYPE, ...: each must work in .env, not just one.
    keys = set(raw_environment(service(name)))
    missing = [env for field, envs in env_names_by_field().items() if field not in NOT_PASSED_THROUGH for env in envs]
    missing = [env for env in missing if env not in keys]
    assert not missing, f"{name}: setting names not passed through: {missing}"


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_no_alias_shadows_another(name: str) -> None:
    # Settings takes the first alias present, even when empty (API_KEY="" hides API_KEYS=a,b): a field passed under
    # two names must leave both unset unless the host sets them.
    env = raw_environment(service(name))
    for field, envs in env_names_by_field().items():
        passed = [key for key in envs if key in env]
        if len(passed) > 1:
            valued = [key for key in passed if env[key] is not None]
            assert not valued, f"{name}: {field} is passed as {passed}; {valued} always set would hide the others"


# ---------------------------------------------------------------------------- (b) the compose values validate


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_compose_defaults_give_the_settings_defaults(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    env = resolved_environment(service(name), host={})
    defaults = settings_under(monkeypatch, {}).model_dump()
    settings = settings_under(monkeypatch, env)
    expected = {**defaults, **PINNED[name]}
    assert settings.model_dump() == expected


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_compose_defaults_serve_the_readme_examples(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # `docker compose up` as it comes: the README's examples name this model and call tools, which need the template
    # that scripts/serve-smollm2.sh gives SmolLM2.
    settings = settings_under(monkeypatch, container_environment(service(name), host={}))
    assert readme_model_names() == {settings.model_name}
    assert "SmolLM2-135M-Instruct" in settings.model
    assert settings.chat_template is not None
    template = in_repository(settings.chat_template)
    assert template == ROOT / "deploy" / "chat-templates" / "smollm2-tools.jinja"
    assert f'"$ROOT/deploy/chat-templates/{template.name}"' in (ROOT / "scripts" / "serve-smollm2.sh").read_text()


@pytest.mark.parametrize("variable", ["MODEL", "HF_MODEL"])
def test_naming_a_model_drops_the_quick_start_defaults(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_under(monkeypatch, container_environment(service("server"), {variable: "org/other"}))
    assert (settings.model, settings.model_name, settings.chat_template) == ("org/other", "org/other", None)


def test_replicas_share_one_gpus_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    single = settings_under(monkeypatch, container_environment(service("server"), {}))
    assert single.kv_cache_memory is None, "one server keeps its own default (0.85 of the free GPU memory)"
    for replicas in (2, 3, 5):
        env = container_environment(service("replica"), {"REPLICAS": str(replicas)})
        fraction = settings_under(monkeypatch, env).kv_cache_memory
        assert fraction is not None and replicas * fraction <= 0.85 + 1e-6 and fraction > 0.8 / replicas
    chosen = container_environment(service("replica"), {"REPLICAS": "3", "KV_CACHE_MEMORY": "2GiB"})
    assert settings_under(monkeypatch, chosen).kv_cache_memory == 2 * 1024**3


OVERRIDES = {
    "HF_MODEL": "Qwen/Qwen2.5-0.5B-Instruct",
    "TORCH_DTYPE": "bfloat16",
    "PORT": "8000",
    "MAX_BATCH_SIZE": "32",
    "DEVICE_MAP": "auto",
    "MAX_MODEL_LEN": "4096",
    "DEFAULT_MAX_TOKENS": "256",
    "TORCH_THREADS": "4",
    "CHAT_TEMPLATE": "/templates/chat.jinja",
    "SERVED_MODEL_NAME": "qwen",
    "API_KEY": "key-1,key-2",
    "ALLOWED_ORIGINS": "https://a.example,https://b.example",
    "AUTH_HEALTH_AND_METRICS": "true",
    "LOG_FORMAT": "json",
}


def test_compose_passes_host_values_on(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_under(monkeypatch, resolved_environment(service("server"), OVERRIDES))
    assert settings.model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert settings.dtype == "bfloat16"
    assert settings.port == 8000
    assert settings.host == "0.0.0.0"
    assert settings.max_batch_size == 32
    assert settings.device_map == "auto"
    assert (settings.max_model_len, settings.default_max_tokens, settings.torch_threads) == (4096, 256, 4)
    assert settings.chat_template == Path("/templates/chat.jinja")
    assert settings.model_name == "qwen"
    assert settings.api_keys == ["key-1", "key-2"]
    assert settings.allowed_origins == ["https://a.example", "https://b.example"]
    assert settings.auth_health_and_metrics is True
    assert settings.log_format == "json"


def test_api_keys_alias_is_passed_on_too(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_under(monkeypatch, resolved_environment(service("server"), {"API_KEYS": "k1,k2"}))
    assert settings.api_keys == ["k1", "k2"]


def test_readme_names_of_settings_are_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    host = {"MODEL": "org/model", "DTYPE": "float16"}
    settings = settings_under(monkeypatch, container_environment(service("server"), host))
    assert (settings.model, settings.dtype) == ("org/model", "float16")


def test_replicas_listen_where_nginx_sends(monkeypatch: pytest.MonkeyPatch) -> None:
    # PORT on the host moves the published port of `server`, never the replicas' internal one.
    settings = settings_under(monkeypatch, resolved_environment(service("replica"), {"PORT": "9000"}))
    assert settings.port == 7088
    assert re.search(r"^\s*server\s+replica:7088\b", NGINX_CONF.read_text(), re.MULTILINE)


# ------------------------------------------------------------------------------------ compose file structure


def gpu_devices(svc: Mapping[str, Any]) -> list[dict[str, Any]]:
    deploy = svc.get("deploy") or {}
    return ((deploy.get("resources") or {}).get("reservations") or {}).get("devices") or []


def test_server_service_runs_like_a_service() -> None:
    server = service("server")
    assert "profiles" not in server, "`docker compose up` must start the GPU server"
    assert server["restart"] == "unless-stopped"
    assert server["build"]["context"] == "."
    assert any(interpolate(str(port), {}) == "7088:7088" for port in server["ports"])
    assert any(
        device["driver"] == "nvidia" and "gpu" in device["capabilities"] and str(device["count"]) in ("all", "1")
        for device in gpu_devices(server)
    )


@pytest.mark.parametrize("name", SERVER_SERVICES)
def test_server_services_keep_the_model_cache_and_probe_health(name: str) -> None:
    svc = service(name)
    hf_home = dockerfile_env()["HF_HOME"]
    assert any(str(volume).split(":")[1] == hf_home for volume in svc["volumes"]), f"{name}: no volume on {hf_home}"
    assert svc["healthcheck"]["test"] == ["CMD", "python", healthcheck_path_in_image()]
    assert svc["restart"] == "unless-stopped"


def test_cpu_profile_builds_without_cuda() -> None:
    cpu = service("cpu")
    assert cpu["profiles"] == ["cpu"]
    assert not gpu_devices(cpu)
    assert cpu["build"]["args"]["TORCH_INDEX"] == "https://download.pytorch.org/whl/cpu"
    assert "BASE_IMAGE" not in cpu["build"]["args"], "one base image for both, so they differ only in torch's build"
    assert cpu["image"] != service("server")["image"]


def test_replicas_profile_sits_behind_nginx() -> None:
    replica, lb = service("replica"), service("lb")
    assert replica["profiles"] == ["replicas"] and lb["profiles"] == ["replicas"]
    assert "ports" not in replica, "replicas are reached through the load balancer only"
    assert int(interpolate(str(replica["deploy"]["replicas"]), {})) >= 2
    assert gpu_devices(replica)
    assert lb["depends_on"]["replica"]["condition"] == "service_healthy"
    assert "./deploy/nginx.conf:/etc/nginx/conf.d/default.conf:ro" in lb["volumes"]
    assert lb["restart"] == "unless-stopped"
    assert lb["healthcheck"]["test"]
    # `server ... resolve` in an upstream block needs nginx 1.27.3 or later.
    version = re.fullmatch(r"nginx:(\d+)\.(\d+)(?:\.(\d+))?-alpine", lb["image"])
    assert version, lb["image"]
    assert tuple(int(part or 99) for part in version.groups()) >= (1, 27, 3)


def test_nginx_config_streams() -> None:
    conf = NGINX_CONF.read_text()
    assert re.search(r"^\s*proxy_buffering\s+off;", conf, re.MULTILINE)
    assert re.search(r"^\s*proxy_request_buffering\s+off;", conf, re.MULTILINE)
    assert re.search(r"^\s*proxy_http_version\s+1\.1;", conf, re.MULTILINE)
    timeout = re.search(r"^\s*proxy_read_timeout\s+(\d+)s;", conf, re.MULTILINE)
    assert timeout and int(timeout.group(1)) >= 600
    assert re.search(r"^\s*proxy_pass\s+http://transformers_openai;", conf, re.MULTILINE)
    assert "location = /nginx-health" in conf and "/nginx-health" in " ".join(service("lb")["healthcheck"]["test"])


@pytest.mark.parametrize(
    ("balancer", "profile", "replicas"),
    [("haproxy", "haproxy", ("gpu0", "gpu1")), ("haproxy-cpu", "haproxy-cpu", ("cpu1", "cpu2"))],
)
def test_haproxy_profiles_put_two_replicas_behind_haproxy(
    balancer: str, profile: str, replicas: tuple[str, ...]
) -> None:
    lb = service(balancer)
    assert lb["profiles"] == [profile] and re.fullmatch(r"haproxy:\d+\.\d+-alpine", lb["image"]), lb["image"]
    assert "./deploy/haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro" in lb["volumes"]
    assert (
        "/haproxy-health" in " ".join(lb["healthcheck"]["test"])
        and "monitor-uri /haproxy-health" in HAPROXY_CFG.read_text()
    )
    env = resolved_environment(lb, {})
    assert [env["REPLICA_1"], env["REPLICA_2"]] == [f"{name}:7088" for name in replicas]
    assert set(lb["depends_on"]) == set(replicas)
    for index, name in enumerate(replicas):
        replica = service(name)
        assert replica["profiles"] == [profile] and "ports" not in replica, "replicas are reached through HAProxy only"
        replica_env = resolved_environment(replica, {"PORT": "9000"})
        assert replica_env["PORT"] == "7088" and replica_env["REPLICA_ID"] == name
        if profile == "haproxy":  # one GPU each
            assert gpu_devices(replica) and replica_env["CUDA_VISIBLE_DEVICES"] == str(index)
        else:
            assert not gpu_devices(replica) and replica_env["DEVICE"] == "cpu"


def test_haproxy_config_checks_readiness_and_retries_refusals() -> None:
    conf = HAPROXY_CFG.read_text()
    for line in (
        'balance "${LB_BALANCE-leastconn}"',
        "http-check send meth GET uri /ready",
        "http-check expect status 200",
        "option http-buffer-request",
        "option redispatch 1",
        'server replica1 "${REPLICA_1}"',
        'server replica2 "${REPLICA_2}"',
    ):
        assert re.search(rf"^\s*{re.escape(line)}\s*$", conf, re.MULTILINE), line
    retry_on = re.search(r"^\s*retry-on\s+(.*)$", conf, re.MULTILINE)
    assert retry_on and {"503", "conn-failure"} <= set(retry_on.group(1).split())
    haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if haproxy is None:
        pytest.skip("haproxy is not installed: the config is not validated by it")
    env = {**os.environ, "REPLICA_1": "127.0.0.1:7001", "REPLICA_2": "127.0.0.1:7002"}
    for balance in ("leastconn", "hdr(X-Session-ID)"):
        result = subprocess.run(
            [haproxy, "-c", "-f", str(HAPROXY_CFG)], env={**env, "LB_BALANCE": balance}, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


# -------------------------------------------------------------------------------------------- (c) Dockerfile


def test_entry_command_is_the_entrypoint_script() -> None:
    entrypoint = instruction_args("ENTRYPOINT")
    assert len(entrypoint) == 1
    command = exec_form(entrypoint[0])
    cmd = instruction_args("CMD")
    assert not cmd or exec_form(cmd[-1]) == [], "a CMD would be replaced by appended flags; keep it empty"
    assert command == ["python", path_in_image("deploy/entrypoint.py")]
    assert entrypoint_module().SERVER_COMMAND == SERVER_MODULE
    # The quick-start template must be in the image where the entry point looks for it.
    template = Path(entrypoint_module().QUICK_START["CHAT_TEMPLATE"])
    assert template.relative_to(ENTRYPOINT_SCRIPT.parent).parts[0] == Path(path_in_image("deploy/chat-templates")).name


def test_entry_command_runs() -> None:
    result = subprocess.run(
        [sys.executable, str(ENTRYPOINT_SCRIPT), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "--model" in result.stdout and "--port" in result.stdout


def test_image_base_is_pinned_and_has_a_cpu_variant() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0][0] == "ARG" and instructions[1] == ("FROM", "${BASE_IMAGE}")
    base = key_values(instructions[0][1])["BASE_IMAGE"]
    assert re.fullmatch(r"python:3\.\d+-slim-\w+", base), base
    args: dict[str, str] = {}
    for arguments in instruction_args("ARG"):
        args.update(key_values(arguments))
    assert args["TORCH_INDEX"] == "", "the default image is the CUDA build from PyPI; the cpu service picks the index"
    assert any('pip install ".[gguf,quantization]"' in run for run in instruction_args("RUN"))


def test_one_torch_version_for_image_and_scripts() -> None:
    args: dict[str, str] = {}
    for arguments in instruction_args("ARG"):
        args.update(key_values(arguments))
    spec = torch_spec_of_env_script()
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+", spec), spec
    assert args["TORCH_SPEC"] == spec
    assert any("${TORCH_SPEC}" in run and "${TORCH_INDEX:+" in run for run in instruction_args("RUN"))
    docs = [README, *sorted(DOCS.glob("*.md"))]
    stated = {found for doc in docs for found in re.findall(r"torch==[\d.]+", doc.read_text())}
    assert stated == {spec}, f"the README and docs/ state {stated}, the scripts and image install {spec}"


def test_image_runs_as_a_non_root_user_and_serves_on_7088() -> None:
    users = instruction_args("USER")
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert instruction_args("EXPOSE") == ["7088"]
    env = dockerfile_env()
    assert env["HOST"] == "0.0.0.0" and env["PORT"] == "7088"
    assert any(env["HF_HOME"] in arguments for arguments in instruction_args("VOLUME"))


def test_healthcheck_runs_the_probe() -> None:
    (healthcheck,) = instruction_args("HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert "--start-period=" in options
    assert exec_form(command) == ["python", healthcheck_path_in_image()]


def test_dockerignore_keeps_junk_out_and_sources_in() -> None:
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    for required in (".venv", ".cache", ".git", "stress-test"):
        assert required in patterns, f".dockerignore lacks {required}"
    assert any("__pycache__" in pattern for pattern in patterns)
    sources = ["pyproject.toml", "README.md", "transformers_openai/main.py", "deploy/healthcheck.py"]
    for arguments in instruction_args("COPY"):
        sources += [part for part in shlex.split(arguments)[:-1] if not part.startswith("--")]
    for source in sources:
        prefixes = ["/".join(Path(source).parts[: i + 1]) for i in range(len(Path(source).parts))]
        assert not any(fnmatch(prefix, pattern.lstrip("/")) for pattern in patterns for prefix in prefixes), source


# ------------------------------------------------------------------------------------------- health probe


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200
    seen: list[tuple[str, str | None]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


@pytest.fixture
def health_server() -> Iterator[tuple[int, type[_Health]]]:
    handler = type("Handler", (_Health,), {"status": 200, "seen": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield httpd.server_address[1], handler
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def closed_port() -> Iterator[int]:
    """A port that nothing listens on (bound, never listening)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def run_probe(env: Mapping[str, str]) -> int:
    base = {
        key: value for key, value in os.environ.items() if key.upper() not in {"HOST", "PORT", "API_KEY", "API_KEYS"}
    }
    result = subprocess.run([sys.executable, str(HEALTHCHECK_SCRIPT)], env={**base, **env}, timeout=30)
    return result.returncode


def test_probe_asks_health_on_the_port(health_server: tuple[int, type[_Health]]) -> None:
    port, handler = health_server
    assert run_probe({"HOST": "0.0.0.0", "PORT": str(port)}) == 0
    assert handler.seen == [("/health", None)]


def test_probe_sends_the_first_api_key(health_server: tuple[int, type[_Health]]) -> None:
    port, handler = health_server
    assert run_probe({"HOST": "0.0.0.0", "PORT": str(port), "API_KEY": " first , second"}) == 0
    assert run_probe({"PORT": str(port), "API_KEYS": "k1,k2"}) == 0
    assert handler.seen == [("/health", "Bearer first"), ("/health", "Bearer k1")]


def test_probe_fails_while_loading_or_down(health_server: tuple[int, type[_Health]]) -> None:
    port, handler = health_server
    handler.status = 503
    assert run_probe({"PORT": str(port)}) == 1
    handler.status = 200
    with closed_port() as closed:
        assert run_probe({"PORT": str(closed)}) == 1


# --------------------------------------------------------------------------------------- (d) the compose CLI


@pytest.fixture
def compose(tmp_path: Path) -> Any:
    cli = compose_cli()
    if cli is None:
        if os.environ.get("CI"):  # scripts/test.sh installs it there: its absence is a set-up failure
            pytest.fail("no compose CLI in CI: scripts/test.sh should have installed docker-compose")
        pytest.skip("no compose CLI (docker compose or docker-compose) installed")
    empty_env_file = tmp_path / "empty.env"  # keeps a developer's .env out of the test
    empty_env_file.write_text("")

    def run(
        *args: str, env: Mapping[str, str] | None = None, env_file: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        profiles = [part for profile in ALL_PROFILES for part in ("--profile", profile)]
        command = [*cli, "-f", str(COMPOSE_FILE), "--env-file", str(env_file or empty_env_file), *profiles, *args]
        full_env = {**host_environment_without_settings(), **(env or {})}
        return subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=120)

    return run


def test_compose_cli_validates_the_file(compose: Any) -> None:
    result = compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_cli_interpolates_and_passes_through(compose: Any) -> None:
    result = compose("config", env={"HF_MODEL": "org/model", "MAX_MODEL_LEN": "2048", "REPLICAS": "3"})
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert set(SERVER_SERVICES) | {"lb"} <= set(services)
    for name in SERVER_SERVICES:
        env = services[name]["environment"]
        assert env["HF_MODEL"] == "org/model" and str(env["MAX_MODEL_LEN"]) == "2048"
        assert env["HOST"] == "0.0.0.0" and str(env["MAX_QUEUE"]) == "64"
        assert env.get("DEVICE_MAP") is None, "unset optional settings stay unset"
    assert services["cpu"]["environment"]["DEVICE"] == "cpu"
    assert int(services["replica"]["deploy"]["replicas"]) == 3


def cli_environment(env: Mapping[str, Any]) -> dict[str, str]:
    """`compose config`'s environment of a service as the container gets it (unset keys left out)."""
    return {
        key: str(value).lower() if isinstance(value, bool) else str(value)
        for key, value in env.items()
        if value is not None
    }


def test_compose_cli_serves_the_readme_examples_model_name(compose: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    result = compose("config")
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in SERVER_SERVICES:
        env = entrypoint_module().server_environment(cli_environment(services[name]["environment"]), [])
        settings = settings_under(monkeypatch, env)
        assert readme_model_names() == {settings.model_name}, name
        assert settings.chat_template is not None and in_repository(settings.chat_template).is_file()


def test_compose_cli_takes_every_readme_name_from_dot_env(compose: Any, tmp_path: Path) -> None:
    dot_env = tmp_path / ".env"
    dot_env.write_text("MODEL=org/model\nDTYPE=float16\nAPI_KEYS=k1,k2\n")
    result = compose("config", env_file=dot_env)
    assert result.returncode == 0, result.stderr
    env = yaml.safe_load(result.stdout)["services"]["server"]["environment"]
    assert (env["MODEL"], env["DTYPE"], env["API_KEYS"]) == ("org/model", "float16", "k1,k2")
