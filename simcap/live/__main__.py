"""``python -m simcap.live run|validate ...``: the ``simcap live`` commands without the main CLI."""

from simcap.live.cli import live_app

if __name__ == "__main__":  # pragma: no cover
    live_app(prog_name="simcap live")
