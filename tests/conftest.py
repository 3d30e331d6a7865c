"""Shared test rules.

- Tests touch only loopback (127.0.0.1) and ask the OS for ports (port 0).
- Every I/O test runs under ``trio.fail_after``; timing-dependent logic uses the autojump clock.
- Loops are bounded in count and time; a test never waits on the wall clock for an assertion.
"""
