"""The core loop: ``core`` (``EngineCore``: schedule, execute, update, step after step),
``core_builder`` (what it drives, built once from the config), ``components`` (which registry
serves which config section; every named implementation checked at assembly) and
``kv_groups_check`` (what a model with several KV-cache groups refuses at start-up). A leaf of
the engine: the process hop (``process/``) starts it in the child and the front ends step it in
this process; it imports neither, only the observers (``observe/``) below it."""
