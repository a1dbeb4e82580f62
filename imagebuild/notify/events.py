"""What a notification says: a CloudEvent (structured mode JSON, spec 1.0), or Slack-compatible text (pure).

Only facts a rollout record or a quarantine mark already holds go in (IDs, channels, waves, regions,
digests, reasons); a target's URL and headers never do, so an event cannot carry a secret of ours.
"""
from __future__ import annotations

import datetime as dt
import json
import uuid
from dataclasses import dataclass
from typing import Any

from imagebuild.core.source import safe_text

CONTENT_TYPE = "application/cloudevents+json"
TYPE_PREFIX = "dev.imagebuild."
SPEC_VERSION = "1.0"


@dataclass(frozen=True)
class Notice:
    """One thing that happened: its kind (release_file.NOTIFY_EVENTS), where it comes from and what it is about."""

    kind: str
    source: str  # the CloudEvent's source: imagebuild/rollout/<id>, imagebuild/quarantine
    subject: str  # the digest (or the rollout ID when there is none)
    data: dict[str, Any]


def rollout_source(rollout_id: str) -> str:
    return f"imagebuild/rollout/{rollout_id}"


def cloud_event(notice: Notice, *, event_id: str | None = None, now: dt.datetime | None = None) -> dict[str, Any]:
    """The CloudEvent of `notice`: one ID, kept across a target's retries so that a receiver can drop repeats."""
    when = (now or dt.datetime.now(dt.timezone.utc)).astimezone(dt.timezone.utc)
    return {
        "specversion": SPEC_VERSION,
        "id": event_id or str(uuid.uuid4()),
        "source": notice.source,
        "type": TYPE_PREFIX + notice.kind,
        "subject": notice.subject,
        "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "datacontenttype": "application/json",
        "data": {key: value for key, value in notice.data.items() if value is not None},
    }


def _slack_escape(text: str) -> str:
    # Slack reads <...> as links and mentions: text from a record must stay text.
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack_text(event: dict[str, Any]) -> dict[str, str]:
    """A Slack-compatible `{"text": ...}` body for `event` (a CloudEvent from cloud_event)."""
    data = event["data"]
    kind = str(event["type"])[len(TYPE_PREFIX):]
    facts = [f"{key} {safe_text(data[key], 100)}" for key in ("rollout", "wave", "region", "gate") if key in data]
    if "channels" in data:
        facts.append("channels " + ", ".join(safe_text(channel, 100) for channel in data["channels"]))
    line = f"imagebuild {kind}: {safe_text(event['subject'], 100)}"
    if facts:
        line += f" ({'; '.join(facts)})"
    if data.get("reason"):
        line += f": {safe_text(data['reason'], 600)}"
    return {"text": _slack_escape(line)}


def body(event: dict[str, Any], form: str) -> tuple[bytes, str]:
    """The request body and its content type for a target of format `form` (cloudevents or slack)."""
    if form == "slack":
        return json.dumps(slack_text(event)).encode(), "application/json"
    return json.dumps(event, sort_keys=True).encode(), CONTENT_TYPE
