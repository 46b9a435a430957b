"""kuangchao_core.config"""
