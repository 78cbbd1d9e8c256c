"""A minimal test runner shared by the SDK scripts (no pytest plugins, one line per test).

Runs the module's `test_*` functions (those named on the command line, or all), prints
`ok`/`FAIL` per test with its traceback, then `sdk: N passed, M failed`, which the Rust drivers
in tests/*.rs read.
"""

import sys
import time
import traceback


def run(namespace: dict, names, version: str) -> int:
    """Runs the `test_*` callables of `namespace` named in `names` (all when empty)."""
    tests = [
        v
        for k, v in sorted(namespace.items())
        if k.startswith("test_") and callable(v) and (not names or k in names)
    ]
    unknown = set(names) - {t.__name__ for t in tests}
    assert not unknown, f"no such tests: {unknown}"
    failed = 0
    for test in tests:
        start = time.monotonic()
        try:
            test()
            print(f"ok   {test.__name__} ({time.monotonic() - start:.1f} s)")
        except Exception:  # noqa: BLE001 - report every failure, then exit non-zero
            failed += 1
            print(f"FAIL {test.__name__}")
            traceback.print_exc(file=sys.stdout)
    print(version)
    print(f"sdk: {len(tests) - failed} passed, {failed} failed")
    return 1 if failed else 0
