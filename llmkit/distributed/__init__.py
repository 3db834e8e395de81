"""What several ranks share: their process groups (``group.py``) and the shared-memory ring
the executor broadcasts each step through (``shm_broadcast.py``)."""
from llmkit.distributed.group import TensorParallelGroup

__all__ = ["TensorParallelGroup"]
