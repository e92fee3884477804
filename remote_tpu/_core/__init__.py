"""What the client and the agent both speak: the shared core.

The agent (``remote_tpu_agent``) imports ``remote_tpu`` only through this
package, and nothing here imports the client's own modules (decorator, options,
target resolver, jobs, local slice, rendering, command line):

- ``proto``: the generated gRPC/protobuf code of ``protos/remote_tpu.proto``;
- ``channels``: credentials, channels and the one stub factory; gRPC status ->
  exception; the Health probe;
- ``auth``: the slice token and TLS settings;
- ``versions``: what this side speaks, and the one compatibility rule;
- ``addresses``: ``ip[:port]`` and every form of ``hosts``;
- ``limits``: chunk sizes and message limits, and how a text is cut;
- ``states``: the one vocabulary of job and host states;
- ``serialization``: the pickled envelope of calls, values and exceptions
  (``remote_exceptions``);
- ``topology``: accelerator names -> hosts, chips and devices;
- ``exceptions``: the errors users see;
- ``local_names``: a name from elsewhere as a local path (the one rule).
"""
