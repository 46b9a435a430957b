"""kuangchao_core.parallel"""
