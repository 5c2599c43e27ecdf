"""`engramd`'s command line: the commands (typer) and the views of status and loads."""
