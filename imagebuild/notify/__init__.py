"""Telling people what a rollout or a quarantine did: CloudEvents (or Slack-compatible text) posted to
release.yaml's `notify:` targets. `events` builds what is sent (pure); `send` posts it in the background,
through oci.retry's one retry engine, within each target's timeout, and never raises into its caller.

May import: core, oci, config.
"""
