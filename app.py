"""SpecArena entry point: `python app.py` serves the app on port 7860.

GRADIO_SERVER_NAME / GRADIO_SERVER_PORT override the address; SPECARENA_QUEUE_SIZE bounds the queue.
The bundled model loads in the background at start, so the first run does not wait for it.
"""

from __future__ import annotations

import os
import threading

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # works offline; sends nothing anywhere

from app.layout import CSS, THEME, build_demo, quiet_queue  # noqa: E402 - after the environment is set
from engine.models.loading import BUNDLED, MODELS  # noqa: E402
from engine.worker import ENGINE  # noqa: E402

demo = build_demo()
demo.queue(max_size=int(os.environ.get("SPECARENA_QUEUE_SIZE", "16")))
quiet_queue(demo)


def preload() -> None:
    """Load the bundled model on the engine thread, where every run's torch work goes, saying what it does
    (ENGINE.note): a first Run pressed meanwhile waits behind it and shows that, with the conversion's and the
    layout timing's progress."""

    def load():
        say = lambda message: ENGINE.note(f"loading the bundled model at start-up: {message}")  # noqa: E731
        say("starting")
        return MODELS.get(BUNDLED, progress=say)

    try:
        ENGINE.call(load)
    except Exception as exc:  # noqa: BLE001 - the UI reports load errors at run time
        print(f"preloading {BUNDLED} failed: {exc}")


if __name__ == "__main__":
    threading.Thread(target=preload, daemon=True).start()
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "0.0.0.0"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        theme=THEME,
        css=CSS,
        footer_links=["api", "gradio"],
    )
