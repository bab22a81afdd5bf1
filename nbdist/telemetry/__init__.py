"""Telemetry: event records from workers and their pure aggregation."""
