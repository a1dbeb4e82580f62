"""What every stage stands on: the error root and its exit codes, the untrusted-file loader (YAML with
line numbers, `safe_text` for quoting), the build report (one record per stage), and the one runner
for subprocesses (cancellation, secret redaction).

May import: nothing of imagebuild.
"""
