"""The process hop: the engine core in its own process, reached over ZMQ with msgpack messages.
``client`` is the API process's side (``MPClient``, which spawns and watches the core process;
``InprocClient``, the same wire types in this process, for tests); ``core`` is the core
process's side (``run_engine_core``, its loop) and the messages both sides exchange. ``core``
must not load torch at import (``tests/test_layering.py``): the process sets OpenMP's wait policy
first."""
