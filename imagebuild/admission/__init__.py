"""The cluster side: AdmissionReview decisions (`review`, pure), the webhook server (`server`), its view
of quarantine marks (`quarantine`), and generated admission policies (`policies`).

May import: core, oci, config, trust, rollout.
"""
