# hpctrial_library(FOLDER SOURCES ... PUBLIC_LINK ... [PRIVATE_LINK ...]): the shared library
# of one top-level folder, hpctrial_<folder>, with its alias hpctrial::<folder>, its public
# headers under <folder>/include, and warnings as errors. Installed into lib/ with its headers
# under include/, and exported as hpctrial::<folder> (cmake/hpctrialConfig.cmake.in).
function(hpctrial_library folder)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_LINK;PRIVATE_LINK" ${ARGN})
  set(target hpctrial_${folder})
  add_library(${target} SHARED ${ARG_SOURCES})
  add_library(hpctrial::${folder} ALIAS ${target})
  target_include_directories(${target}
    PUBLIC $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>
    PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src)
  target_link_libraries(${target} PUBLIC ${ARG_PUBLIC_LINK} PRIVATE ${ARG_PRIVATE_LINK} hpctrial_warnings)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON EXPORT_NAME ${folder}
                                             VERSION ${PROJECT_VERSION} SOVERSION ${PROJECT_VERSION_MAJOR})
  install(TARGETS ${target} EXPORT hpctrialTargets
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
          INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR}/include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
endfunction()
