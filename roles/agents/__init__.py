"""Agents written against the OpenAI API, hosted by the env role (roles/env.py)."""
