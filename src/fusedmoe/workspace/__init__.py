"""Workspace plans and the manager that serves them (see docs/architecture.md)."""

from .manager import (
    STRATEGIES,
    Workspace,
    WorkspaceError,
    WorkspaceFrozenError,
    WorkspaceManager,
    WorkspaceStats,
    caller_workspace,
    default_manager,
)
from .plan import ALIGNMENT, BufferSpec, PlanError, WorkspacePlan

__all__ = [
    "ALIGNMENT",
    "STRATEGIES",
    "BufferSpec",
    "PlanError",
    "Workspace",
    "WorkspaceError",
    "WorkspaceFrozenError",
    "WorkspaceManager",
    "WorkspacePlan",
    "WorkspaceStats",
    "caller_workspace",
    "default_manager",
]
