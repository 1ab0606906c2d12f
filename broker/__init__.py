"""zeroserve broker: the wire protocol, the public client, the scheduler and the socket loop."""

__version__ = "0.1.0"
