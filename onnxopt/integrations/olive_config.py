"""The Olive package config that registers onnxopt's pass (:mod:`onnxopt.integrations.olive_pass`).

Olive finds third-party passes through ``olive run --package-config FILE``, and that file
*replaces* Olive's own ``olive_config.json`` instead of adding to it: a recipe that also uses
``OnnxConversion`` or ``OnnxFloatToFloat16`` needs them in the same file. So the file is made from
the installed Olive's own config plus the ``Onnxopt`` entry, rather than shipped as a copy that
would go stale with the next Olive release; regenerate it after upgrading Olive::

    python -m onnxopt.integrations.olive_config olive_packages.json
    olive run --config recipe.json --package-config olive_packages.json

From Python: ``olive.workflows.run(recipe, package_config=package_config())``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from onnxopt.errors import OnnxoptError
from onnxopt.integrations import require

PASS_TYPE = "Onnxopt"
PASS_CLASS = "onnxopt.integrations.olive_pass.OnnxoptPass"


def package_config() -> dict[str, Any]:
    """The installed Olive's package config with this pass added (see the module docstring)."""
    require("olive", "'onnxopt[olive]' (olive-ai)")
    from olive.package_config import OlivePackageConfig

    with open(OlivePackageConfig.get_default_config_path()) as f:
        config = json.load(f)
    config.setdefault("passes", {})[PASS_TYPE] = {
        "module_path": PASS_CLASS,
        "supported_providers": ["*"],
        "supported_accelerators": ["*"],
        "supported_precisions": ["*"],
        "supported_algorithms": [],
        "supported_quantization_encodings": [],
    }
    return config


def main(argv: list[str] | None = None) -> int:
    """``python -m onnxopt.integrations.olive_config FILE``: write the package config to FILE."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m onnxopt.integrations.olive_config PACKAGE_CONFIG.json", file=sys.stderr)
        return 2
    try:
        config = package_config()
    except OnnxoptError as exc:
        print(f"onnxopt: {exc}", file=sys.stderr)
        return exc.exit_code
    Path(argv[0]).write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {argv[0]}: Olive's passes plus '{PASS_TYPE}'; run: olive run --config RECIPE --package-config {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
