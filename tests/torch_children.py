"""How long a test waits for a Python child that imports torch (and ferry's engine modules with it)."""

# Importing torch takes about 3 s on a quiet machine and took 28-34 s on the 2-core test VM at load 12 (two
# pytest workers, two CPU hogs and other runs beside them), where bounds of 30 s (a child's) and 60 s (a test's
# two children) failed. A bound on such a child guards against a hang; it checks no speed.
TORCH_CHILD_TIMEOUT_S = 120.0
