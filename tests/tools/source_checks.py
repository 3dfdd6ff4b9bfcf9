"""What the tests of the source checks (tools/check-*) share: a check loaded as a module, and its
violations in a tree of sources written for the test."""
import importlib.machinery
import importlib.util
import pathlib
import sys
import tempfile

TOOLS = pathlib.Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))  # the checks' own module (source_text.py), as when they run as scripts


def load(name):
    """tools/<name> as a module."""
    loader = importlib.machinery.SourceFileLoader(name.replace("-", "_"), str(TOOLS / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def violations(check, files):
    """check.violations() of a tree holding `files` ({path under src/: text}) alone."""
    with tempfile.TemporaryDirectory() as d:
        root = pathlib.Path(d)
        for name, text in files.items():
            path = root / "src" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return check.violations(root)
