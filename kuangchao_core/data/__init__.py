"""kuangchao_core.data"""
