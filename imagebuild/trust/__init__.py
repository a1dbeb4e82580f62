"""Signatures and attestations: signing with cosign (`sign`), predicates (`attest`), the release record
(`provenance`), and in-process verification (`verify`), which the push, rollout and webhook share; the
signed OpenVEX document of an image (`vex_attest`).

May import: core, oci, config, checks.
"""
