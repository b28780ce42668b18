"""``python -m tide.extension``: build (or load) the CUDA extension ahead of time, printing the build's
output; exits with status 2 and the reason when it cannot be had."""
import sys

from tide import extension

try:
    extension.load(verbose=True)
except RuntimeError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
print("tide.transport: the CUDA extension is built", file=sys.stderr)
