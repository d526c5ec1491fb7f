"""Typed exceptions. Every error a user can cause is one of these, with a one-line message that names
what is wrong and what would fix it; the CLI prints the message and exits with status 2."""

from __future__ import annotations


class K3optError(Exception):
    """Base class for every error a user can cause."""


class SpecError(K3optError):
    """A model, cluster, layout or job file is malformed, empty, or breaks a field rule."""


class PresetNotFoundError(K3optError):
    """A preset name or file path that does not exist."""


class LayoutError(K3optError):
    """A layout that cannot exist for this model and cluster (split, divisibility, degrees)."""


class InfeasibleJobError(K3optError):
    """A job for which no layout fits; the message carries the smallest reachable peak."""


class SearchTimeoutError(InfeasibleJobError):
    """The search ended at its time limit before it found a layout or proved that none fits."""


class UnknownTargetError(K3optError):
    """A launch format or job target that k3opt cannot export to."""
