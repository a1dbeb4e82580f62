"""imagebuild: a hardened build and release pipeline for PaddlePaddle GPU images.

One subpackage per concern, importing one way (tests/test_layout.py holds the arrows):
core -> oci -> config -> build -> checks -> trust -> release | rollout -> admission -> cli.
Each subpackage's __init__ says what it owns and what it may import.
"""
