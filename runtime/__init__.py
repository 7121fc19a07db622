"""Execution of plans on Ray-managed actors (built in a later issue; imports engine, torch, ray)."""
