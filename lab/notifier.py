"""The run notifier (OLMo's Slack notifier): a webhook told when the run starts and how it ends. A
module of its own, imported where train.py's `build_run` enters it, so that `import train` reads
none of the webhook's code.
"""

import json
import os
import sys

from config import CHECKS, ConfigError


class Notifier:
    """log.slack_webhook, or the SLACK_WEBHOOK_URL environment variable (OLMo's Slack notifier): a
    short JSON message ({"text": ...}, Slack's incoming-webhook format) when the run starts, and
    when it finishes, is stopped early (a signal, CANCEL, the time limit) or fails. Rank 0 posts. A
    post that fails is a warning, never the run's end. A context manager: entered as the loop is
    about to start; on leaving, it posts `outcome`, or the error."""

    def __init__(self, url, name, is_master):
        # (log.slack_webhook is checked with the config)
        url = url or os.environ.get("SLACK_WEBHOOK_URL", "")
        webhook = "an http:// or https:// URL, or empty"  # the setting's own check (config.py)
        if not CHECKS[webhook](url):  # on every rank, so that all stop
            raise ConfigError(f"the SLACK_WEBHOOK_URL environment variable must be {webhook} (its "
                              "value is not shown: a secret); set it to the webhook's https:// "
                              "URL, or unset it.")
        self.url = url if is_master else ""
        self.name, self.outcome = name, "ended"

    def post(self, text, ending=False):
        """Post `text`; `ending`: the run's last message (a failure is then not followed by
        "training goes on")."""
        if not self.url:
            return
        import urllib.request

        request = urllib.request.Request(self.url,
                                         data=json.dumps({"text": f"{self.name}: {text}"}).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=10).close()
        except Exception as error:  # noqa: BLE001 - a notification is never worth the run
            print("warning: the run notifier could not post to its webhook "
                  f"({type(error).__name__}: {error}); "
                  + ("the run's outcome is as printed above." if ending else "training goes on."),
                  file=sys.stderr,
                  flush=True)

    def __enter__(self):
        self.post("started")
        return self

    def __exit__(self, kind, error, traceback):
        if error is None:
            self.post(self.outcome, ending=True)
        else:
            self.post(f"failed: {(str(error).splitlines() or [type(error).__name__])[0][:300]}",
                      ending=True)
