"""``python tests/interrupt_on_import.py MODULE ARGS...``: runs ``python -m MODULE ARGS...`` with a
Ctrl-C raised the moment anything imports torch, as a user's Ctrl-C lands in the seconds a command
spends importing its heavy code."""
import importlib.abc
import runpy
import sys


class CtrlCOnTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch":
            raise KeyboardInterrupt
        return None


if __name__ == "__main__":
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    sys.meta_path.insert(0, CtrlCOnTorch())
    runpy.run_module(module, run_name="__main__", alter_sys=True)
