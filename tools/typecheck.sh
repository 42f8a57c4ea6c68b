#!/usr/bin/env bash
# mypy --strict over the package as it is imported: the design card's folders (adapters/,
# conformance_tests/) are mapped into rollout_backends.* by setuptools, so mypy gets the same
# view through a tree of symlinks. The benchmarks (bench/rb_bench, run from a checkout) too, and the
# adapter authors' examples: the toy adapter and the Wire skeleton docs/adapters.md shows.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
stage="$root/.rb-cache/typecheck"
rm -rf "$stage"; mkdir -p "$stage/rollout_backends"
for f in "$root"/rollout_backends/*; do ln -s "$f" "$stage/rollout_backends/$(basename "$f")"; done
ln -s "$root/adapters" "$stage/rollout_backends/adapters"
ln -s "$root/conformance_tests" "$stage/rollout_backends/conformance"
ln -s "$root/bench/rb_bench" "$stage/rb_bench"
ln -s "$root/examples/toy_adapter/toy_adapter" "$stage/toy_adapter"
ln -s "$root/examples/my_wire.py" "$stage/my_wire.py"
cd "$stage"
exec "${PYTHON:-python}" -m mypy --config-file "$root/pyproject.toml" -p rollout_backends -p rb_bench -p toy_adapter \
    -m my_wire "$@"
