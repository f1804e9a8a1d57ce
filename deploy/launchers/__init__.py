"""Launchers: what starts a cluster's groups, one file each behind ``base.Launcher``."""
