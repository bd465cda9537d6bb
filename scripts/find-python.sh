#!/usr/bin/env sh
# Prints the path of a Python >= 3.12 (JAX 0.12's floor): one on PATH first, else one that pyenv installed.
# Exits 1 with a one-line hint on stderr when there is none.
ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }
for c in python3 python3.14 python3.13 python3.12; do
    p=$(command -v "$c" 2>/dev/null) && ok "$p" && { echo "$p"; exit 0; }
done
root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
for p in $(ls -d "$root"/versions/3.1[2-9]*/bin/python 2>/dev/null | sort -V); do
    ok "$p" && { echo "$p"; exit 0; }
done
echo "cfp needs Python >= 3.12 (JAX 0.12's floor): install one (e.g. 'pyenv install 3.12') or run 'make PY=/path/to/python3.12'" >&2
exit 1
