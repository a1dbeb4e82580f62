"""Signatures and attestations: signing with cosign (`sign`), predicates (`attest`), the release record
(`provenance`), and in-process verification (`verify`), which the push, rollout and webhook share.

May import: core, oci, config, checks.
"""
