"""What several routers share (tenant budgets, the fleet's size, sessions' replicas, the
prefix index, streams in flight), behind one interface with two backends chosen by the
router's ``state`` setting: ``memory`` (one router, this process) and ``redis`` (any
number of routers over one Redis)."""

from services.router.shared.settings import SharedSettings
from services.router.shared.state import SharedState, build_shared_state

__all__ = ["SharedSettings", "SharedState", "build_shared_state"]
