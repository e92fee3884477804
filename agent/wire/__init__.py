"""How bytes cross between hosts beside gRPC: the data port and its tickets
(``data_port``), a gateway's link to each peer for cold calls (``peer_link``,
``peer_link_server``), a warm session's lane to each peer (``peer_lane``) and
the caller's lane to the gateway (``caller_lane``; the caller's end is
``remote_tpu/_call_lane.py``), and who this agent and its peers are
(``discovery``). Links and lanes all ride the one connection kind of
``remote_tpu._core.frame_connection``: each module keeps only what its frames mean.

May import: only ``remote_tpu._core`` and other ``wire`` modules.
"""
