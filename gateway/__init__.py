"""zeroserve gateway: the Starlette HTTP front end (KServe v2 and friends)."""
