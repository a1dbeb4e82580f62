"""The OCI layer: the image-reference grammar now; the client, auth, retry and copy move here later."""
