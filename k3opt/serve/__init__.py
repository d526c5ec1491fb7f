"""The planning lab in the browser (`k3opt serve`): a FastAPI app over evaluate(), plan() and pareto()
(serve/app.py), the page under serve/static, and the plans it runs (serve/runs.py). Needs the `serve` extra."""

from k3opt.serve.app import create_app

__all__ = ["create_app"]
