"""rla_compile's benchmarks: each module a script, run from the repository root as

    python -m benchmarks.runtime --sizes small --json /tmp/r.json

(a package, so the scripts share `benchmarks.common` by import; docs/performance.md has the
numbers and the commands that wrote them)."""
