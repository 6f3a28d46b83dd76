"""Temporal activities: every side effect of an invoke (resolve, call, deliver the callback)."""

from activities.invoke import ReachActivities

__all__ = ["ReachActivities"]
