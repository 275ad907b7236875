"""servelab: a notebook workbench for LLM-serving performance investigations."""
__version__ = "0.1.0"
