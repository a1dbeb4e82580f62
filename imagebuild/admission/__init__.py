"""The cluster side: AdmissionReview decisions (`review`, pure), the webhook server (`server`), its view
of quarantine marks (`quarantine`), and generated admission policies and manifests (`policies`, pure; the
webhook's image pinned by digest in `webhook_image`).

May import: core, oci, config, checks (the OpenVEX keys the policies read), trust, rollout.
"""
