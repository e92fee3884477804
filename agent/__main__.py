from remote_tpu_agent.server.cli import main

raise SystemExit(main())
