"""kuangchao_core.engine"""
