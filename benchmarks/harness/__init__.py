"""What every benchmark (and the tests' redis-server fixture) shares.

* :mod:`.server`: a throw-away redis-server, round-trip counting, compiled trees;
* :mod:`.procs`: child processes (start, stop, kill, wait) and waits with a message;
* :mod:`.meters`: CPU meters (a process, redis-server, the machine) and statistics;
* :mod:`.report`: rows of figures, the console table, and the one writer of the
  generated blocks of docs/benchmarks.md.
"""
