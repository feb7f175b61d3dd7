from kembed_api.cli import app

app()
