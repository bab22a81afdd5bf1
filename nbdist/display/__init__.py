"""Views of sessions and runs: text (baseline), static HTML, widgets. Never talks to engines."""
