"""The `hostagent` command line. Human tables by default, `--json` for machines.

`hostagent.cli.parser` builds the parser (the one place that registers every command group) and dispatches;
`hostagent.cli.common` holds what the groups share (output, settings, options, the API client, exit statuses);
each command group lives in the module named for it. The console script is `hostagent.cli.parser:main`; this
package's own module is empty, so that importing a group module does not load the whole command line.

Exit status: 0 success; 1 the operation failed (a FAIL check, a refused request); 2 bad usage or configuration;
3 the agent's API could not be reached.
"""

