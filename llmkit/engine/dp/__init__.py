"""Data parallel: ``parallel.data_parallel_size`` engine cores behind one front end. ``client``
(``DPClient``, the cores as one process client), ``engine`` (``DataParallelEngine``, what the
offline ``LLM`` steps), ``router`` (which core serves a request), ``placement`` (where each core
runs) and ``stats`` (the cores' stats as one)."""
