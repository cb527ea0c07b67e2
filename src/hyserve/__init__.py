"""hyserve: an OpenAI-compatible server for hybrid recurrent/attention models with an exact-state prefix cache."""

__version__ = "0.1.0"

# Importing hyserve changes nothing in the process: its commands apply their settings at start
# (`process_settings.apply`).
