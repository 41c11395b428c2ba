"""Import one of ``scripts/`` as a module, for tests of its functions (the scripts are not a package)."""

import importlib.util
import os

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def load_script(filename: str):
    """The module ``scripts/<filename>``, freshly executed."""
    spec = importlib.util.spec_from_file_location(
        os.path.splitext(filename)[0] + "_script", os.path.join(SCRIPTS, filename)
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
